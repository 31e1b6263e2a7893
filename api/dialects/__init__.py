"""The wire dialects harnesses speak: Anthropic Messages, OpenAI Chat, OpenAI Responses.

Each dialect module owns its whole wire format: ``to_chat`` turns its request into one
chat-completions request, ``reply`` turns a captured call into its reply, ``stream``
replays that reply as the server-sent events its SDK expects, and ``error_body`` shapes its
errors. ``common`` holds what they share.
"""
