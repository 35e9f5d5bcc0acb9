"""OpenAI-compatible server over the glm5 engine: `app.create_app(engine)` (routes, auth, errors),
`async_engine.AsyncEngine` (engine thread, admission, dynamic batching, hot swap), GLM parsers in
`parsers/`. Run it with `glm5 serve` (glm5/cli/serve.py); see docs/serve.md."""
