"""transformers must not take the project's `kernels` for Hugging Face's."""

from __future__ import annotations


def check_transformers():
    """transformers decides whether Hugging Face `kernels` is there by package metadata: the import
    name `kernels` resolves to this project's package, whose distribution (kernel-service, 0.1.x)
    is outside the range transformers takes, so its hub hooks stay stubs. Were it ever in range (or
    HF's distribution installed), transformers would import this project's `kernels` as HF's."""
    from transformers.utils import import_utils

    if import_utils.is_kernels_available():
        raise ImportError(
            "transformers takes the `kernels` package for Hugging Face's kernels (a `kernels` distribution in its version range "
            "is installed); this project's `kernels` package has the same top-level name: uninstall Hugging Face's `kernels`"
        )
