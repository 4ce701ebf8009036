"""The ``helm`` fixture: every chart test runs with helm 4 and with helm 3 (tests/deployment/helm.py
finds them; a missing one skips, saying how to install it)."""

from __future__ import annotations

import pytest

from deployment.chart import helms
from deployment.helm import Helm


@pytest.fixture(params=helms())
def helm(request: pytest.FixtureRequest) -> Helm:
    found: Helm = request.param
    return found
