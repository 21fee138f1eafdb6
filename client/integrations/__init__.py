"""Integrations of served kernels with other libraries; each imports its library lazily.

- `client.integrations.hf`: `kernelize(model)` for Hugging Face transformers models.
"""
