def cp_shared_kv_enabled(server_args):
    return cp_mode(server_args).shards_kv
def lane_aware(cache):
    return getattr(get_server_args(), MODE_ATTR, None) is not None
def on_extend(cache):
    return getattr(cache.server_args, '_cp_hicache_mode', None)
