"""The remote checkpoint tier: checkpoints shared through an S3-compatible bucket."""
