"""Model code (plain PyTorch) that reads and writes K/V through the paged cache."""
