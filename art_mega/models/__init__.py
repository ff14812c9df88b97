"""Model directories art-mega builds or converts for tests and examples (Hugging Face format).

Nothing here downloads: models are made from configs and locally trained tokenizers.
"""
