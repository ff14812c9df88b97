"""The Megatron trainer: HF checkpoints in, megatron-core GPTModel ranks over NCCL or gloo.

Modules import torch and megatron-core lazily or are only imported by trainer rank processes.
"""
