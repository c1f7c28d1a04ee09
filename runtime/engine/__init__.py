"""The engine core, backend-independent: `Sequence`, `Scheduler` and `EngineCore.step()` = schedule -> run ->
postprocess."""
