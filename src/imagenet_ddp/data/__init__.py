"""The data stages: archives, split, the prepared copy, the dataset, node staging."""
