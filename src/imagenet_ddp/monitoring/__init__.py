"""What a running job reports: TensorBoard, MLflow, W&B, NVML, its cost."""
