"""What the `war` command tests share: a tiny synthetic sweep experiment."""

SYNTHETIC_EXPERIMENT = """\
name: tiny
workload: {kind: synthetic, rl_steps: 1, group_size: 2, num_tasks: 2, copies: true,
           turns_median: 2.0, max_turns: 3, response_median: 20.0, max_response: 50,
           tool_tokens_median: 10.0, task_tokens_median: 20.0, system_tokens: 10,
           tool_median_s: 0.1}
cost: {kind: linear, intercept_s: 0.01, per_token_s: 1.0e-5, kv_tokens: 65536}
sim: {num_replicas: 2, max_tokens: 128}
drafts: live
loads: [1]
configs:
  rr: {policy: round_robin, spec_mode: "off"}
  war: {policy: war, spec_mode: always}
"""
