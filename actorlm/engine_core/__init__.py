"""The engine core in a process of its own: the frontend here, the scheduler, the KV allocator
and the executor there, the engine's messages between them over ZMQ (``wire``), and a core
that dies restarted with its requests resumed (``client``). ``start_engine`` picks it or the
in-process ``EngineSystem`` from ``EngineConfig.engine_core_process``."""

from actorlm.engine_core.engine import EngineCoreSystem, start_engine

__all__ = ["EngineCoreSystem", "start_engine"]
