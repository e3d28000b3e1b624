"""Datasets for private training: small built-in ones (offline), the user's image folders and tables."""

from .digits import digits_dataset, digits_features
from .image_folder import image_folder_eval_set, image_folder_splits, is_image_folder
from .table import is_table, read_table, table_eval_set, table_splits

__all__ = [
    "digits_dataset",
    "digits_features",
    "image_folder_splits",
    "image_folder_eval_set",
    "is_image_folder",
    "is_table",
    "read_table",
    "table_splits",
    "table_eval_set",
]
