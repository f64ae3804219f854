// The OpenAI Node SDK (`openai`) against the router, as docs/integrations/openai-node.md
// shows it: a streamed chat with usage, then a tool call streamed by the SDK's helper,
// run here, and its result sent back. Prints one JSON object for
// tests/test_client_node_sdks.py to check.
import OpenAI from "openai";

const { ROUTER_URL, HIVENET_ROUTER_API_KEY, MODEL, TOOL_SECRET } = process.env;
const client = new OpenAI({
  baseURL: `${ROUTER_URL}/v1`,
  apiKey: HIVENET_ROUTER_API_KEY,
  maxRetries: 0,
  timeout: 75_000,
});

// 1. A streamed answer, with the usage chunk at its end.
const stream = await client.chat.completions.create({
  model: MODEL,
  messages: [{ role: "user", content: "hello from node" }],
  stream: true,
  stream_options: { include_usage: true },
});
let text = "";
let deltas = 0;
let finish = null;
let usage = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  const choice = chunk.choices[0];
  if (choice?.delta?.content) {
    text += choice.delta.content;
    deltas += 1;
  }
  if (choice?.finish_reason) finish = choice.finish_reason;
}

// 2. A tool the application runs: the model asks, the code answers, the model replies.
const tools = [
  {
    type: "function",
    function: {
      name: "lookup_code",
      description: "The access code for a key",
      parameters: {
        type: "object",
        properties: { key: { type: "string" } },
        required: ["key"],
      },
    },
  },
];
const lookupCode = ({ key }) => `code for ${key} is ${TOOL_SECRET}`;
const messages = [
  { role: "user", content: 'Find the code. sim:call lookup_code {"key": "alpha"}' },
];
const runner = client.chat.completions.stream({ model: MODEL, messages, tools });
const first = await runner.finalChatCompletion();
const asked = first.choices[0].message;
const call = asked.tool_calls[0];
messages.push(asked, {
  role: "tool",
  tool_call_id: call.id,
  content: lookupCode(JSON.parse(call.function.arguments)),
});
const final = await client.chat.completions.create({ model: MODEL, messages, tools });

console.log(
  JSON.stringify({
    stream: { text, deltas, finish, usage },
    tool_call: {
      finish: first.choices[0].finish_reason,
      name: call.function.name,
      arguments: JSON.parse(call.function.arguments),
    },
    final: { text: final.choices[0].message.content, finish: final.choices[0].finish_reason },
  }),
);
