"""The worker: lease loop, modelet pipeline in stage processes, exactly-once writer."""
