"""The local backend: workers as child processes of the controller on this machine
(`backend`), their pid files and the orphans a killed controller leaves (`pidfiles`), how a
worker's exit reads (`exits`), and this machine's cores among them (`cores`)."""
