"""The engine room: the one place that builds a vLLM engine (`build`), reads its start-up refusals and
memory needs (`start`), the vLLM plugins it runs (`cpu_isa`, `prompt_scores`, `state_sketch`, `runner`)
and the list of every vLLM/speculators internal the project touches (`surface`)."""
