"""The wire dialects harnesses speak: Anthropic Messages, OpenAI Chat, OpenAI Responses.

Each dialect module turns its request into one chat-completions request (``to_chat``) and a
captured call back into its reply (``reply``); ``api.sse`` streams that reply.
"""
