"""vtoken.spec: z3 models and CrossHair contracts of the core (see docs/spec.md). Filled by the spec issue."""
