"""The scheduler <-> runner contract: the per-step records both runners read and return
(SchedulerOutput, ModelRunnerOutput), the samplers' SamplerOutput, SamplingParams and
the request outputs. Imports nothing of the project but `policy`."""
