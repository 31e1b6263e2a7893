"""Prompts the front end builds itself (``model_server.prompts: faithful``).

``vocab`` loads a tokenizer without a hub download, ``renderer`` builds a renderer of the
``renderers`` package on it, ``canonical`` names a conversation by what the policy said in
it, ``lineage`` finds the call a request continues, and ``faithful`` turns a chat request
into a token-in engine call and the sampled ids back into a served message.
"""
