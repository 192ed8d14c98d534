from __future__ import annotations

import os

import pytest
import torch

from tests.support.tiny_models import TINY_VARIANTS, make_tiny_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: str(make_tiny_model(root / name, **kw)) for name, kw in TINY_VARIANTS.items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama-gqa"]
