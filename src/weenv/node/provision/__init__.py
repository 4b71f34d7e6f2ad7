"""Elastic provisioning: each environment's CPU quota and memory limit follow its
observed usage (issue 5).

- :mod:`~weenv.node.provision.policy`: per environment, usage history -> wanted
  quota and limit (pure);
- :mod:`~weenv.node.provision.arbiter`: all wants -> grants within the node's
  capacity, freeze/thaw, admission (pure);
- :mod:`~weenv.node.provision.controller`: the loop that reads and writes cgroups,
  each of its passes in :mod:`~weenv.node.provision.passes`;
- :mod:`~weenv.node.provision.models`: configuration and statistics models.
"""

from weenv.node.provision.controller import Provisioner
from weenv.node.provision.models import ProvisionConfig, ProvisionStats

__all__ = ["ProvisionConfig", "ProvisionStats", "Provisioner"]
