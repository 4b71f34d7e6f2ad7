"""weenv under agent harnesses, their code unchanged: one module per harness.

- :mod:`weenv.adapters.minisweagent`: ``WeenvEnvironment``, a mini-swe-agent
  environment (its ``environment_class`` setting:
  ``weenv.adapters.minisweagent.WeenvEnvironment``).
- :mod:`weenv.adapters.nemo`: ``WeenvProvider``, a NeMo Gym sandbox provider
  registered as ``weenv`` in the ``nemo_gym.sandbox_providers`` entry point
  group (``pip install 'weenv[nemo]'``).
- :mod:`weenv.adapters.swerex`: ``WeenvDeployment``, a SWE-ReX deployment
  (``pip install 'weenv[swerex]'``) whose runtime server runs in an
  environment, its files a layer group of their own.

These map the harness's resources onto an environment's *ceiling*
(:class:`~weenv.formats.manifest.Resources`: ``cpus``, ``memory_bytes``,
``disk_bytes``): under elastic provisioning an environment starts near the
node's floor (``ProvisionConfig.cpu_floor`` / ``memory_floor``) and grows up
to it (:mod:`weenv.node.provision.policy`); a GPU request is refused.
A sandbox's lifetime becomes the environment's ``timeout`` (the node destroys
it then), a command's timeout the command's (killed, exit 137).  The node an
environment runs on is ``Sandbox.node`` (its daemon's address).  Their calls go
through the SDK, so :func:`weenv.meter` counts them.
"""
