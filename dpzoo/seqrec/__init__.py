"""Sequential recommendation: data, metrics and DPFormer (issue 5)."""
