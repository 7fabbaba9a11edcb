#!/usr/bin/env bash
# Writes src/serve/chat_page.c: src/serve/chat_page.html as the C string lm_chat_page_html
# (the chat page that `linmoe serve` answers GET / with). Run after editing the HTML;
# tests/test_server.c checks that the two agree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
in=src/serve/chat_page.html out=src/serve/chat_page.c
{
    echo "/* Generated from chat_page.html by scripts/embed_page.sh: do not edit. */"
    echo "const char lm_chat_page_html[] ="
    sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/^/    "/' -e 's/$/\\n"/' "$in"
    echo "    ;"
} >"$out"
