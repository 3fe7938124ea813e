"""A pairing's target sharded over several processes with `mx.distributed`.

The daemon stays outside the group: `group` launches the ranks with `mlx.launch` and talks to
rank 0 over a local socket; `target` is the daemon's stand-in for the sharded model, whose
caches (`shadow`) journal every operation the engine performs; `worker` is the rank process,
where rank 0 broadcasts each journal to every rank (`wire`) and all of them replay it.
Imports mlx and the engine's own modules, never starlette.
"""
