"""Experiment harness: the models and datasets that gradzip's benchmarks train on.

    train_set, info = load_dataset("fashion-mnist")
    model = build_model("cnn", info)
"""
from .data import DATASETS, DataNotFoundError, DatasetInfo, load_dataset
from .models import MODELS, build_model, model_options, task_of

__all__ = ["DATASETS", "DataNotFoundError", "DatasetInfo", "load_dataset", "MODELS", "build_model", "model_options", "task_of"]
