"""What runs inside a call on a worker (over `gpufn.wire`): what user code and the worker
share while a function executes.

- `context`: `gpufn.context()`, the call's rank, world size, device, group and mesh;
- `call_options`: `@gpu(autocast=..., device_args=True)` applied around the function;
- `models`: how `Model.get()` finds the instance resident on this device.
"""
