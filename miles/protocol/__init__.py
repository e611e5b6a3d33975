"""Wire formats: the SGLang native API subset and the OpenAI-compatible API, as typed models.

The embedded engine serves these models and the controller's clients speak them, so a rollout
server is interchangeable with a real SGLang server.
"""
