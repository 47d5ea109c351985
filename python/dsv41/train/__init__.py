"""Training the small V4.1 model the eval harness ships with (docs/train.md)."""
