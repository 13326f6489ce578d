"""The plan_parallelism stage: how to split training over the devices, and why.

Modules: `shape` (exact parameter counts), `memory` and `throughput` (pure
models of one candidate), `plan` (the validated layout, and plan.json's types), `search`
(candidates and the choice), `table` (parallelism_data.json, local or hub) and
`resolve` (config, then table, then planner).
"""
