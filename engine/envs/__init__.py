"""Environments a policy acts in over several turns: the interface (reset, step), the tool-using
environment, tools and their schemas, tool-call parsers, the sandbox that runs model-written code,
and the encoder that appends observations to a trajectory's token ids without re-tokenising it.

Owns: base (Environment, EnvStep), tool_env, tools, tool_calls, sandbox (+ sandbox_init, its
launcher script), chat (ConversationEncoder, CHATML_TOOLS_TEMPLATE).
May import: seeds, faults, errors (the config checks an env's class and tools through this package).
"""
