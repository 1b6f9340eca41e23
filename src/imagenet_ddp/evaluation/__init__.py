"""The evaluate stage: one rank's evaluation of a trained model."""
