"""distcomm: the communication layer of distributed training, in Rust, for Python.

``import distcomm.torch`` registers ``"distcomm"`` as a torch.distributed backend (torch also
finds it through the ``torch.distributed.backends`` entry point once this package is
installed, so ``torch.distributed.init_process_group("distcomm")`` works without the import).
"""

from ._distcomm import MAX_TAG, Group, Work, __version__

__all__ = ["Group", "Work", "MAX_TAG", "__version__"]
