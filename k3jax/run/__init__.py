"""Run set-up shared by the commands that run a model (train, rl, generate, serve, eval):

  model      open a model folder or checkpoint: its config, its weights for a run or for
             serving (`Experts`, `keep_packed`, `load_for_serving`)
  options    the run's execution (dtypes, remat, ...) and adaptation (LoRA, MXFP4) from its
             options
  params     the parameter trees a run trains: split, adapted, trainable / frozen
  placement  shardings of the parameters from the rules table; the initial parameters,
             created, loaded or adapted and placed
  resume     OUT/run.json and the checks a resume passes
  start      a run's process: compilation cache, processes joined, mesh

It sits below the train step and the serving engine (docs/architecture.md#floors): nothing
here compiles or knows a step.
"""
