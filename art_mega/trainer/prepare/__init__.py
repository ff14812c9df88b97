"""Controller-side preparation of a trainer step: tokenization and packing of documents, advantages,
the memory plan of a run. Torch-free; never imported by a rank.
"""
