"""The simulator: the engine's scheduler, KV cache manager and block pool on a virtual clock, a
step-time model in place of the model runner, fleets of replicas behind routers. Torch-free.
``setup.setup_fleet`` builds a fleet from a :class:`kvledger.config.SimulatorConfig`."""
