"""SWE-ReX on weenv (``pip install 'weenv[swerex]'``): ``WeenvDeployment``, a
SWE-ReX deployment whose runtime server runs in a weenv environment, and its
config model ``WeenvDeploymentConfig`` (:mod:`weenv.adapters.swerex.deployment`).
The server comes as a layer group of its own
(:mod:`weenv.adapters.swerex.server_group`), so a task's template needs no
change to serve SWE-ReX."""

from weenv.adapters.swerex.deployment import (
    WeenvDeployment,
    WeenvDeploymentConfig,
    WeenvRuntime,
)

__all__ = ["WeenvDeployment", "WeenvDeploymentConfig", "WeenvRuntime"]
