#!/usr/bin/env bash
# Checks that includes only point down fulgur's layers (DESIGN.md, "Growing
# it"): for each rule below, no file of the layer (include/fulgur/<layer>/ and
# src/<layer>/, public "fulgur/..." and private "<layer>/..." include paths
# alike) includes a header of a forbidden layer. Prints each offending
# include as file:line, and exits 1 when there is one.
#
#   scripts/check-layering.sh [REPO_ROOT]     (CTest: layering)
#
# Known exceptions, when a move cannot be finished at once, go in
# scripts/layering-exceptions.txt as "file -> included/header.h  # issue N: why";
# each must name its issue, and one that no longer occurs fails the check
# too (remove its line).
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root"

# layer: the layers (top-level folders, or a header's path without its
# extension) its files may not include. Lowest first; an include only ever
# points down.
rules=(
  "core: data loggers accelerators nn metrics optim distributed plugins strategies trainer callbacks cli tuner tools bench"
  "distributed: core/module plugins strategies trainer callbacks cli tuner tools bench"
  "strategies: trainer callbacks cli tuner tools bench"
)

exceptions_file=scripts/layering-exceptions.txt
declare -A excepted=()
bad_exceptions=""
if [[ -f $exceptions_file ]]; then
  while IFS= read -r line; do
    [[ -z $line || $line == \#* ]] && continue
    if [[ ! $line =~ ^([^[:space:]]+)\ -\>\ ([^[:space:]]+)\ +\#\ issue\ [0-9]+:\ .+$ ]]; then
      bad_exceptions+="  $exceptions_file: \"$line\" is not \"file -> header  # issue N: why\""$'\n'
      continue
    fi
    excepted["${BASH_REMATCH[1]} -> ${BASH_REMATCH[2]}"]=0
  done <"$exceptions_file"
fi

violations=""
for rule in "${rules[@]}"; do
  layer=${rule%%:*}
  forbidden=(${rule#*:})
  dirs=()
  for d in "include/fulgur/$layer" "src/$layer"; do [[ -d $d ]] && dirs+=("$d"); done
  ((${#dirs[@]})) || continue
  while IFS= read -r hit; do
    file=${hit%%:*}
    rest=${hit#*:}
    line=${rest%%:*}
    text=${rest#*:}
    header=$(sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]([^>"]+)[>"].*/\1/' <<<"$text")
    path=${header#fulgur/}
    target=${path%%/*}
    stem=${path%.*}
    for f in "${forbidden[@]}"; do
      if [[ $target == "$f" || $stem == "$f" ]]; then
        [[ $target == "$f" ]] && what="$f/" || what="$f"
        key="$file -> $header"
        if [[ -n ${excepted[$key]+x} ]]; then
          excepted[$key]=1
        else
          violations+="  $file:$line: $layer/ includes $header ($what is above $layer/)"$'\n'
        fi
        break
      fi
    done
  done < <(grep -rnE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]' "${dirs[@]}" || true)
done

for key in "${!excepted[@]}"; do
  if [[ ${excepted[$key]} == 0 ]]; then
    bad_exceptions+="  $exceptions_file: \"$key\" no longer occurs: remove its line"$'\n'
  fi
done

if [[ -n $violations || -n $bad_exceptions ]]; then
  [[ -n $violations ]] && printf 'includes that point up the layers (see DESIGN.md, "Growing it"):\n%s' "$violations"
  [[ -n $bad_exceptions ]] && printf '%s' "$bad_exceptions"
  exit 1
fi
echo "layering: every include points down (${#rules[@]} rules, ${#excepted[@]} known exceptions)"
