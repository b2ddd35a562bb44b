"""`KubernetesScaler`: a `Scaler` over the official ``kubernetes`` client — each pool is a Deployment,
sized through its ``scale`` subresource, its pods watched for readiness.

The RBAC rules below are the only API calls it makes; the chart renders its Role from the same list
(`tests/unit/test_helm_chart.py` checks the two agree, and the scaler's tests check it calls nothing else).
"""

from __future__ import annotations

from typing import Any


def rbac_rules(actuate: bool) -> list[dict[str, Any]]:
    """The Role rules the scaler needs: read (and, when it actuates, patch) the pools' scale
    subresource; list and watch pods for readiness."""
    return [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "verbs": ["get", "patch"] if actuate else ["get"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    ]
