"""The controller: keeps each running job's workers between its min and max, within capacity."""
