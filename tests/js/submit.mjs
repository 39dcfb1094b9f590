// Submit a job to Ebb from nats.js, as docs/running-jobs.md shows: the job map as JSON,
// Nats-Msg-Id set to the job id, replies (the JetStream ack) to the client role's inbox prefix.
// node submit.mjs URL CREDS_FILE PREFIX BODY_FILE MSG_ID
import { readFileSync } from "node:fs";
import { connect, credsAuthenticator, headers } from "nats";

const [url, credsFile, prefix, bodyFile, msgID] = process.argv.slice(2);
const nc = await connect({
  servers: url,
  authenticator: credsAuthenticator(readFileSync(credsFile)),
  inboxPrefix: `_INBOX.${prefix}.client`,
});
const h = headers();
h.set("Content-Type", "application/json");
const ack = await nc.jetstream().publish(`${prefix}.jobs.submit`, readFileSync(bodyFile), {
  msgID,
  headers: h,
});
console.log(JSON.stringify({ stream: ack.stream, seq: ack.seq, duplicate: ack.duplicate }));
await nc.drain();
