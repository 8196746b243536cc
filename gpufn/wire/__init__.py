"""What every gpufn process speaks. It imports nothing of gpufn but `exceptions`, and no zmq.

In reading order:
- `protocol`: every message that crosses a process boundary, and the one codec;
- `serialization`: user code, arguments, results and exceptions as zero-copy frames;
  `byvalue`: which modules travel by value inside pickled code;
- `spec`: `@gpu(...)` options, validated; `units`: sizes ("20GiB") to bytes and back;
- `config`: every GPUFN_* setting, with its default;
- `rendezvous`: a gang's rendezvous (backend choice, the scheduler-hosted TCPStore);
- `versions`: the Python and cloudpickle versions peers compare when they connect.
"""
