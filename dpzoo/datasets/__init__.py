"""Datasets for private training: small built-in ones (offline) and the user's image folders."""

from .digits import digits_dataset
from .image_folder import image_folder_eval_set, image_folder_splits, is_image_folder

__all__ = ["digits_dataset", "image_folder_splits", "image_folder_eval_set", "is_image_folder"]
