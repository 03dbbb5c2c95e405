"""vtoken.fuzz: Hypothesis state machines and the `vtoken fuzz` campaign runner. Filled by the fuzzer issue."""
