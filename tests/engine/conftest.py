"""Tiny seeded models shared by the engine tests (fixtures over ``engine_helpers``)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_model

from war.engine.model import CausalLM


@pytest.fixture(scope="module")
def model64() -> CausalLM:
    return tiny_model(0, torch.float64)
