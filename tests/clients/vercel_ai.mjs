// The Vercel AI SDK (`ai` with `@ai-sdk/openai-compatible`) against the router, as
// docs/integrations/vercel-ai-sdk.md shows it: streamText, then a tool the SDK runs
// itself between two steps, streamed and not. Prints one JSON object for
// tests/test_client_node_sdks.py to check.
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";

const { ROUTER_URL, HIVENET_ROUTER_API_KEY, MODEL, TOOL_SECRET } = process.env;
const hivenet = createOpenAICompatible({
  name: "hivenet",
  baseURL: `${ROUTER_URL}/v1`,
  apiKey: HIVENET_ROUTER_API_KEY,
  includeUsage: true,
});

// 1. A streamed answer.
const streamed = streamText({ model: hivenet(MODEL), prompt: "hello from vercel", maxRetries: 0 });
let text = "";
let deltas = 0;
for await (const delta of streamed.textStream) {
  text += delta;
  deltas += 1;
}
const usage = await streamed.usage;
const finish = await streamed.finishReason;

// 2. A tool the SDK calls between steps: step 1 is the model's call, step 2 its answer.
const tools = {
  lookup_code: tool({
    description: "The access code for a key",
    inputSchema: jsonSchema({
      type: "object",
      properties: { key: { type: "string" } },
      required: ["key"],
    }),
    execute: async ({ key }) => `code for ${key} is ${TOOL_SECRET}`,
  }),
};
const steps = (result) =>
  result.steps.map((step) => ({
    finish: step.finishReason,
    calls: step.toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
    results: step.toolResults.map((r) => r.output),
    text: step.text,
  }));
const whole = await generateText({
  model: hivenet(MODEL),
  prompt: 'Find the code. sim:call lookup_code {"key": "beta"}',
  tools,
  stopWhen: stepCountIs(3),
  maxRetries: 0,
});
const live = streamText({
  model: hivenet(MODEL),
  prompt: 'Find the code. sim:call lookup_code {"key": "gamma"}',
  tools,
  stopWhen: stepCountIs(3),
  maxRetries: 0,
});
let liveText = "";
for await (const delta of live.textStream) liveText += delta;

console.log(
  JSON.stringify({
    stream: { text, deltas, finish, usage },
    tool_whole: { text: whole.text, steps: steps(whole) },
    tool_stream: { text: liveText, steps: steps({ steps: await live.steps }) },
  }),
);
