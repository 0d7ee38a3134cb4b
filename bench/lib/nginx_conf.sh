# nginx_conf DIR UPSTREAM_PORT LISTEN_PORT [EXTRA_MAIN_LINES]: writes DIR/nginx.conf for nginx as a plain
# reverse proxy (1 worker, access log off, upstream keep-alive 64, HTTP/1.1 to the upstream) on 127.0.0.1,
# with its pid, logs and temp folders under DIR — the reference proxy of bench/ab.sh and bench/instructions.sh.
nginx_conf() {
  local dir=$1 up=$2 listen=$3 extra=${4:-}
  mkdir -p "$dir/tmp" "$dir/logs"
  cat >"$dir/nginx.conf" <<CONF
worker_processes 1;
${extra}pid $dir/nginx.pid;
error_log $dir/logs/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/tmp/body;
  proxy_temp_path $dir/tmp/proxy;
  fastcgi_temp_path $dir/tmp/fastcgi;
  uwsgi_temp_path $dir/tmp/uwsgi;
  scgi_temp_path $dir/tmp/scgi;
  upstream app { server 127.0.0.1:$up; keepalive 64; }
  server { listen 127.0.0.1:$listen; location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; } }
}
CONF
}
