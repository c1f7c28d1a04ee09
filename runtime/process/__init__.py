"""Runtime stage: the engine in a process of its own, so that the server survives a fault that poisons the device."""
