"""The built-in zoo entries. Importing this package registers them."""

from . import bert, efficientnet, gpt2, llama, resnet, seqrec, vit  # noqa: F401
