"""Dictionary training (the `train:` block): sparse autoencoders and transcoders trained from a store or the model."""
