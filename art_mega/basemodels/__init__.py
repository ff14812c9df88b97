"""Base models: resolving `TrainableModel.base_model` (`resolve`), and the model directories
art-mega builds or converts for tests and examples (Hugging Face format: `tiny`, `tiny_moe`,
`smollm2`).

Nothing here downloads: models are made from configs and locally trained tokenizers.
(Named `basemodels`, not `models`, so it reads apart from `trainer/families/`, the HF <-> Megatron
conversion of each model family.)
"""
