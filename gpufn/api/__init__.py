"""The user's SDK (over `gpufn.client`, `gpufn.runtime` and `gpufn.wire`); its public names
are re-exported by `gpufn`.

In reading order:
- `function`: `@gpu` and `Function` (.remote/.spawn/.map/.local/.with_options);
- `calls`: `FunctionCall`, `CallStream`, `gather`: handles on calls already made;
- `call_forms`: `f.remote_gen` and the decoration-time checks of generators and async;
- `map_run`: one `.map()` (windowed submission, ordering, cancel); `progress`: its bar;
- `model`: `@gpufn.model`; `cache`: the result cache of `@gpu(cache=...)`;
- `deployment`: `gpufn.deploy` and app operations; `lookup`: deployed functions by name;
- `users`: a cluster's users and their tokens (`gpufn token ...`).
"""
